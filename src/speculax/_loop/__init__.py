"""The speculative sampling loop: draft, verify, append, repeat under one `jit`,
with its key schedule and the interface of the models it runs."""
