"""``verify preflight``: a Megatron-Core configuration, validated as production does, on paper.

``flags`` reads Megatron's flags, ``config`` resolves and validates them,
``model`` lists the GPT parameters per pipeline stage and chunk, ``paper`` and
``timing`` compute the figures, ``render`` prints and writes them, ``cli`` is
the subcommand.
"""
