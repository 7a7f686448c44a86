"""The GPU suite's sections, one module each (see ``benchmarks/gpu_bench.py``).

Each section module has ``run(args, out, budget)`` (measure, store into ``out``) and
``summarize(out, args) -> list[str]`` (its lines of the summary table).
"""
