"""Measurement: the diagnosis's timings (diagnose.py), the profile and roofline (profile.py), the
memory plan (memory.py), FLOPs and MFU (mfu.py), the alignment warnings (alignment.py), the
sweep comparison and its seed groups (comparison.py, seed_groups.py) and the figures they draw
(figures.py). The modes that run them on a composed run are trainer/modes/."""
