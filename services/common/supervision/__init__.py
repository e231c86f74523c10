"""Supervision of service processes, shared by ``pdserve launch`` (the whole topology) and
``pdserve gateway --workers N`` (its worker processes): ``spec`` (one process: command, health,
liveness, start stage), ``child`` (one running process and its output), ``supervisor`` (start in
stages, restart crashes and hangs, drain and stop), ``console`` (progress and the children's lines).
"""
