"""What surrounds a run: doctor, download, benchmarks, the synthetic checkpoint writer,
budget reports, logit comparison.

May import: every room but ``cli``.
"""
