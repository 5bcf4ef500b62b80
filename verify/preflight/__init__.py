"""``verify preflight``: a Megatron-Core configuration, validated as production does, on paper.

``flags`` reads a launch line with Megatron-LM core_r0.19.0's own flag table,
``resolve`` applies validate_args' defaults into a ``config`` that validates
itself (``rules``; ``pipeline_split`` for the layers of every stage and chunk),
``model`` lists the GPT parameters per pipeline stage and chunk, ``paper`` and
``timing`` compute the figures, ``render`` prints and writes them, ``cli`` is
the subcommand.
"""
