"""Imported only by the fork server that starts rank processes (restart.rank_processes preloads it first),
for its one effect there: the server ignores the stop signals (bootstrap.STOP_SIGNALS, named here so that
the server ignores them before its first import of torch). Slurm signals every process of a job step, the
server included, and a server killed by SIGTERM loses the exit status of every rank it started
(multiprocessing then reports 255 for each), so a rank that saved and stopped would look failed. Its forks
inherit the ignoring; a rank process sets the default back first thing (`restart.run_rank`)."""

import signal

for stop_signal in (signal.SIGTERM, signal.SIGUSR2):
    signal.signal(stop_signal, signal.SIG_IGN)
