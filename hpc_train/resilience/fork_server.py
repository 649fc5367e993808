"""Imported only by the fork server that starts rank processes (restart.rank_processes preloads it), for its
one effect there: the server ignores the stop signals. Slurm signals every process of a job step, the
server included, and a server killed by SIGTERM loses the exit status of every rank it started
(multiprocessing then reports 255 for each), so a rank that saved and stopped would look failed. Its forks
inherit the ignoring; a rank process sets the default back first thing (`restart.run_rank`)."""

import signal

from hpc_train.bootstrap import STOP_SIGNALS

for stop_signal in STOP_SIGNALS:
    signal.signal(stop_signal, signal.SIG_IGN)
