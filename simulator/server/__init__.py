"""The simulated SGLang server: HTTP front, routes, endpoints, served metrics, faults, launches."""
