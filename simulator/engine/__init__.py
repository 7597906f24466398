"""The discrete-event SGLang engine and its models: requests, series, SGLang-shaped metrics,
memory, prefix cache, cost, acceptance.
"""
