"""The phases of a run, in the order trainer/run.py wires them: compose, identify, build, plan
(the resolve phase), prepare, fit (fit and test) and record. Each module does its phase's one job;
only trainer/run.py calls them in order."""
