"""How a worker process ends, as its parent (``tokenfleet worker``'s supervisor,
systemd, Kubernetes) reads it; sysexits.h's numbers. One place, and light to
import: the supervisor runs where the worker's own modules may not load."""

# The device failed (EX_SOFTWARE): non-zero, so it is restarted, and counted
# toward giving up on the worker.
FATAL = 70
# The engine stopped on a step that a job most likely broke, on a device that
# works (EX_TEMPFAIL): restarted at once and not counted against the device.
JOB_FAULT = 75
# The configuration is wrong (EX_CONFIG: the model vanished, say): a restart
# cannot help, so it is not restarted.
CONFIG = 78
# The parent's own code for a setup mistake, as the command line's others.
SETUP = 2
