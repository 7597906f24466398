"""The in-engine side: what runs inside SGLang (its policy protocol, the step-table policy, the
EMA, the fixed step, SGLang's adaptive config).
"""
