"""``python -m verify``: the same as the ``verify`` console script."""

from verify.cli import console_main

console_main()
