"""The daemon runtime: the control loop, its state store, control API, health, own metrics, restart
loop and configuration.
"""
