"""Process exit codes shared by the trainer and the launchers.

A launcher decides whether to restart a job from its exit code alone, so each code below means
exactly one thing. The launchers restart on PREEMPTED_EXIT_CODE and PEER_LOST_EXIT_CODE only;
any other non-zero code is for a person to read.

  0                    the run finished.
  BAD_INPUT_EXIT_CODE  (2) a config field, the data, the workdir or a task is wrong: one line on
                       stderr names it. Nothing was written over.
  DIVERGED_EXIT_CODE   (3) too many non-finite updates (in a row, or among recent ones).
  PREEMPTED_EXIT_CODE  (42) the run was told to stop (SIGTERM: TPU maintenance, spot reclaim, a
                       scheduler; or SIGHUP: its terminal closed, unless `nohup` ignores it),
                       wrote a checkpoint if it had progress to save, and exited:
                       start the same command again and it resumes.
  PEER_LOST_EXIT_CODE  (43) a multi-worker peer vanished mid-run: restart all workers together
                       (they resume from the last checkpoint). A peer that never arrives within
                       `config.peer_timeout_s` is different: TF blocks in C++ then, so a watchdog
                       prints one line and SIGKILLs the worker (exit -9/137, not restarted).
  CHECKPOINT_IO_EXIT_CODE  (74, EX_IOERR) a checkpoint could not be written (disk full,
                       permissions, its directory deleted: the previous checkpoint is still the
                       latest) or read for a reason other than damage (storage unavailable:
                       nothing was moved), or another workdir file (a TensorBoard summary,
                       result.json, an export) could not be written on a full or read-only disk.
  INTERRUPTED_EXIT_CODE  (130) Ctrl-C (SIGINT): a checkpoint was written if there was progress;
                       rerun to resume. Not restarted by the launchers: a person asked to stop.

This module must stay free of TensorFlow imports: the launchers import it on machines that only
run `gcloud` or `ssh`.
"""

BAD_INPUT_EXIT_CODE = 2
DIVERGED_EXIT_CODE = 3
PREEMPTED_EXIT_CODE = 42
PEER_LOST_EXIT_CODE = 43
CHECKPOINT_IO_EXIT_CODE = 74
INTERRUPTED_EXIT_CODE = 130
