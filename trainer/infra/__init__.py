"""What every run stands on: one-line errors (errors.py), atomic files (atomic.py), signals and
child processes (signals.py, processes.py), the attempts of a run (attempts.py), resuming
(resume.py), how a run that did not finish ends (failures.py), summary.json (summary.py), several
processes and devices (distributed.py, devices.py), the environment fingerprint (fingerprint.py)
and library log routing (library_logs.py). A new failure policy goes here."""
