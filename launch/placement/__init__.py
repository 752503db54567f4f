"""The executor of placement: the launcher's side of the pure ``yatt.placement``.

``inputs`` (this machine's slots, peak and the model's sizes: the planner's inputs, and the
run's plan), ``plan_file`` (``plan.json``: written by the launcher, read back by each role,
which pins itself), ``adapter`` (each step's measured times into the replanner),
``executor`` (a changed plan carried out between two steps) and ``command``
(``python -m launch plan``).
"""
