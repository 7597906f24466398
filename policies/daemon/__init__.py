"""The daemon side: the daemon policy protocol and the policies behind it (fixed schedules,
goodput, bandit), their estimators and spec syntax.
"""
