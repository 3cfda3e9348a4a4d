"""docs/tasks.md's worked example runs verbatim, from a directory outside the repository.

Every ```python block whose first line is `# file: NAME` is written to NAME in a temporary
directory; every ```sh block whose first line is `# run:` is run there with bash, `$WORKDIR` set
and `python` being this interpreter. Readers copy this example: it must never rot.
"""
import json
import os
import re
import subprocess
import sys

import numpy as np
import tensorflow as tf

import helpers

_BLOCK = re.compile(r"```(python|sh)\n(.*?)```", re.DOTALL)


def _blocks(path):
  with open(path) as f:
    text = f.read()
  files, commands = {}, []
  for kind, body in _BLOCK.findall(text):
    first, _, rest = body.partition("\n")
    if kind == "python" and first.startswith("# file: "):
      files[first[len("# file: "):].strip()] = body
    elif kind == "sh" and first.startswith("# run:"):
      commands.append(rest)
  return files, commands


def test_tasks_md_worked_example_runs_verbatim(tmp_path):
  files, commands = _blocks(os.path.join(helpers.REPO, "docs", "tasks.md"))
  assert set(files) == {"my_task.py", "my_config.py"} and len(commands) == 1
  project = tmp_path / "project"
  project.mkdir()
  for name, body in files.items():
    (project / name).write_text(body)
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  shim = bin_dir / "python"  # A script, not a symlink: a venv is found from the invoked path.
  shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
  shim.chmod(0o755)
  workdir = tmp_path / "workdir"
  env = dict(os.environ, WORKDIR=str(workdir), TF_CPP_MIN_LOG_LEVEL="2",
             PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
             PYTHONPATH=helpers.REPO)  # This checkout, as `pip install -e .` would give.
  done = subprocess.run(["timeout", "-k", "5", "600", "bash", "-euc", commands[0]], cwd=project,
                        env=env, capture_output=True, text=True, timeout=620, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "train step 80/80" in done.stderr
  result = json.loads((workdir / "result.json").read_text())
  assert result["global_step"] == 80 and result["skipped_updates"] == 0
  assert result["eval"]["examples"] == 512.0
  assert result["eval"]["accuracy"] > 0.9, result  # The task is learnable in 80 updates.
  config = json.loads((workdir / "config.json").read_text())
  assert (config["strategy"], config["cpu_replicas"], config["accumulation"]["steps"]) == (
      "mirrored", 2, 4)
  served = tf.saved_model.load(result["export"])
  tokens = np.full((2, 16), 9, np.int32)
  tokens[0, 3] = 7
  logits = served.serve(tf.constant(tokens)).numpy()
  assert logits.shape == (2, 2) and logits[0].argmax() == 1 and logits[1].argmax() == 0


def _leaf_fields(node, prefix=""):
  for key in node.keys():
    if hasattr(node[key], "keys"):
      yield from _leaf_fields(node[key], f"{prefix}{key}.")
    else:
      yield prefix + key


def test_config_md_names_every_field_and_built_in_task():
  """docs/config.md says it documents every field; it missed `accumulation.mode`,
  `contrastive.*` and `histogram.*`, and listed 4 of the 7 built-in tasks (a probe,
  2026-12-07)."""
  from trainer import config_defaults  # pylint: disable=g-import-not-at-top
  from trainer import tasks  # pylint: disable=g-import-not-at-top
  with open(os.path.join(helpers.REPO, "docs", "config.md")) as f:
    text = f.read()
  fields = list(_leaf_fields(config_defaults.base_config()))
  assert len(fields) > 50
  assert [f for f in fields if f"`{f}`" not in text] == []
  task_row = next(line for line in text.splitlines() if line.startswith("| `task` |"))
  assert [t for t in tasks.BUILT_IN if t not in task_row] == []


def test_design_md_names_every_module_of_the_package():
  """docs/design.md's module table is where a new engineer starts; it missed
  `trainer/tasks/batch_losses.py` (a probe, 2026-12-08)."""
  with open(os.path.join(helpers.REPO, "docs", "design.md")) as f:
    table = "\n".join(line for line in f if line.startswith("| `trainer/"))
  package = os.path.join(helpers.REPO, "trainer")
  modules = [f"trainer/{name}" for name in sorted(os.listdir(package)) if name.endswith(".py")]
  assert [m for m in modules if f"`{m}`" not in table] == []
  tasks_row = next(line for line in table.splitlines() if line.startswith("| `trainer/tasks/`"))
  built_in = [name for name in sorted(os.listdir(os.path.join(package, "tasks")))
              if name.endswith(".py") and name != "__init__.py"]
  assert len(built_in) >= 5 and [n for n in built_in if f"`{n}`" not in tasks_row] == []
  for package_dir in ("per_example", "bench", "tasks"):
    assert f"`trainer/{package_dir}/`" in table, package_dir
