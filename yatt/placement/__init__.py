"""Placement: which role instance runs on which device slot, and the planner that picks it.

``plan.py`` holds the data (cluster spec, costs, the plan); ``planner.py`` the pure cost
model and search. Neither imports a launcher or a worker: the executor that turns a plan
into processes lives beside the launcher (``launch/placement/plan_file.py``).
"""
