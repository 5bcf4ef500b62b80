"""How long a test waits for a child process or a rank before calling it hung.

A hang guard, not a speed test (speed is shown by bench/, never by a timed test): in a loaded
run of the suite (``bench/bench_suite_loaded.py --suite``: 8 spinners beside
``scripts/test.sh``, load 25 on average and 53 at most on 2 cores) ``verify run --list`` took
over 60 s to start, and a 60 s guard failed a test whose process was only starved. Fifteen
minutes is the whole suite's budget: a real hang still ends the test.
"""

HANG_GUARD_S = 900
