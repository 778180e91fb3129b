"""readie's benchmarks: ``make bench`` (python -m bench.run), see docs/benchmarks.md.

Every figure that matters is a ratio of two arms measured side by side in the
same run, because these machines are noisy (two shared cores): absolute
milliseconds move between runs, ratios of interleaved samples much less.
"""
