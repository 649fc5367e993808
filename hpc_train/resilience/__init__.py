"""What keeps a long run alive on a flaky cluster: injected faults for the tests (faults.py), the hang
watchdog, straggler detection, preemption (stop, checkpoint, requeue), the ledger of blamed nodes and the
in-job restart of failed ranks. It stands on rank bootstrap alone, so the launchers and the loop use it."""
