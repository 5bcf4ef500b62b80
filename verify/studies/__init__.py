"""Command-line studies, one room per technique.

A study measures something over a sweep (error growth with DP size, padding
overhead, pipeline bubbles) rather than checking one implementation against its
reference. Each study module (or package) is named after its technique and
exposes ``configure_parser(parser)`` and ``main(args) -> int`` for ``verify``'s
subcommands.
"""
