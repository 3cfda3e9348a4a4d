"""Process exit codes shared by the trainer and the launchers.

A launcher decides whether to restart a job from its exit code alone, so each code below means
exactly one thing. Any other non-zero code is a real failure: the launchers never restart it.

  0                    the run finished.
  PREEMPTED_EXIT_CODE  the run was told to stop (SIGTERM, TPU maintenance, spot reclaim), wrote a
                       checkpoint and exited: start the same command again and it resumes.
  PEER_LOST_EXIT_CODE  a multi-worker peer vanished mid-run: restart all workers together (they
                       resume from the last checkpoint). A peer that never arrives within
                       `config.peer_timeout_s` is different: TF blocks in C++ then, so a watchdog
                       prints one line and SIGKILLs the worker (exit -9/137, not restarted).

This module must stay free of TensorFlow imports: the launchers import it on machines that only
run `gcloud` or `ssh`.
"""

PREEMPTED_EXIT_CODE = 42
PEER_LOST_EXIT_CODE = 43
