"""The fleet governor's runtime: the smg gateway client, one mode move carried out, its metrics."""
