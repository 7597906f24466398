"""The control core: one decision of the daemon as a pure step, driven by daemon and replay; the
fleet mix.
"""
