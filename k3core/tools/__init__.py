"""What surrounds a run: doctor, download, benchmarks, the synthetic checkpoint writer,
budget reports, logit comparison, tuning a preset on this machine (``k3 tune``).

May import: every room but ``cli``.
"""
