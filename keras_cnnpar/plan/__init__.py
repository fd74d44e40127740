"""Choosing and comparing strategies: the planner behind ``cnnpar plan`` and ``strategy="auto"``, the memory
estimate, the step-time split, the parity checks, and sweeps with their report."""
