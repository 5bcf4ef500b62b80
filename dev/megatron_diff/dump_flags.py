"""Write Megatron-LM's own flag table (every option of ``parse_args``) for preflight.

``verify/preflight/megatron_flags.json`` is generated here from
``megatron/training/arguments.py add_megatron_arguments`` (megatron-core 0.19.2),
so that preflight reads a launch line with the same option names, arities,
types and choices as Megatron-LM's argparse. Run with the Megatron environment
of ``megatron_env.py``::

    .venv/bin/python dev/megatron_diff/dump_flags.py
"""

from __future__ import annotations

import argparse
import enum
import json
from pathlib import Path

import megatron_env

OUT = Path(__file__).resolve().parents[2] / "verify" / "preflight" / "megatron_flags.json"
KINDS = {"_StoreAction": "store", "_StoreTrueAction": "store_true",
         "_StoreFalseAction": "store_false", "BooleanOptionalAction": "boolean_optional"}
TYPES = {int: "int", float: "float", str: "str", None: "str"}


def flag_table() -> list[dict]:
    """One entry per argparse action of Megatron-LM's parser (help excluded)."""
    megatron_env.load()
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    table = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        kind = KINDS[type(action).__name__]  # KeyError: a new kind of action to support
        type_name, choices = TYPES.get(action.type, "other"), action.choices
        if choices is not None and all(isinstance(c, enum.Enum) for c in choices):
            type_name, choices = "enum", [c.name for c in choices]  # given by name on the line
        elif type_name == "other":
            choices = None  # a converter of Megatron's own decides; preflight takes the text
        table.append({
            "flags": list(action.option_strings), "dest": action.dest, "action": kind,
            "nargs": action.nargs, "type": type_name,
            "choices": None if choices is None else [str(c) for c in choices],
        })
    return table


def main() -> None:
    table = flag_table()
    head = json.dumps({"megatron": "megatron-core 0.19.2 (Megatron-LM core_r0.19.0)",
                       "source": "megatron/training/arguments.py add_megatron_arguments, "
                                 "written by dev/megatron_diff/dump_flags.py"})
    rows = ",\n".join(json.dumps(action, separators=(",", ":")) for action in table)
    OUT.write_text(head[:-1] + ', "actions": [\n' + rows + "\n]}\n", encoding="utf-8")
    print(f"wrote {OUT} ({len(table)} actions)")


if __name__ == "__main__":
    main()
