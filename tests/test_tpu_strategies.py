"""What the TPU launcher needs from trainer/strategies.py and the config, with TF's classes faked.

  * `tpu_address` may name a pod slice: the resolver gets the name and the process connects to
    the slice as a cluster (the one TF client on worker 0); `local` does not connect.
  * The multi-worker collective timeout is its own field (`collective_timeout_s`, 0: none), no
    longer `peer_timeout_s`, so a slow first compile is not read as a lost peer.
No TPU and no second worker are involved: the TF constructors are replaced by recorders.
"""
import contextlib
import json
import logging

import pytest
import tensorflow as tf

from trainer import config_defaults
from trainer import strategies
from trainer import validation


def tpu_config(address):
  config = config_defaults.base_config()
  config.strategy, config.tpu_address = "tpu", address
  return config


@pytest.fixture
def fake_tpu(monkeypatch):
  """Replaces the TF TPU entry points; returns the list of calls they saw."""
  calls = []

  class Resolver:
    def __init__(self, tpu):
      calls.append(("resolver", tpu))

  monkeypatch.setattr(tf.distribute.cluster_resolver, "TPUClusterResolver", Resolver)
  monkeypatch.setattr(tf.config, "experimental_connect_to_cluster",
                      lambda resolver: calls.append(("connect",)))
  monkeypatch.setattr(tf.tpu.experimental, "initialize_tpu_system",
                      lambda resolver: calls.append(("initialize",)))
  monkeypatch.setattr(tf.distribute, "TPUStrategy", lambda resolver: "tpu-strategy")
  return calls


def test_tpu_address_may_name_a_pod_slice(fake_tpu, monkeypatch):
  monkeypatch.setenv("TPU_LOAD_LIBRARY", "0")
  assert strategies.create_strategy(tpu_config("my-slice")) == "tpu-strategy"
  assert fake_tpu == [("resolver", "my-slice"), ("connect",), ("initialize",)]


def test_local_tpu_does_not_connect_to_a_cluster(fake_tpu):
  strategies.create_strategy(tpu_config("local"))
  assert fake_tpu == [("resolver", "local"), ("initialize",)]


def test_slice_client_without_tpu_load_library_0_is_warned(fake_tpu, monkeypatch, caplog):
  monkeypatch.delenv("TPU_LOAD_LIBRARY", raising=False)
  with caplog.at_level(logging.WARNING):
    strategies.create_strategy(tpu_config("my-slice"))
  assert "without TPU_LOAD_LIBRARY=0" in caplog.text


@pytest.mark.parametrize("collective_timeout_s, expected", [(0, None), (900, 900.0)])
def test_collective_timeout_is_separate_from_peer_timeout(monkeypatch, collective_timeout_s,
                                                          expected):
  seen = {}
  monkeypatch.setenv("TF_CONFIG", json.dumps({
      "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
      "task": {"type": "worker", "index": 0}}))
  monkeypatch.setattr(strategies, "_killed_if_stuck",
                      lambda seconds, message: seen.update(arrival=seconds) or
                      contextlib.nullcontext())
  monkeypatch.setattr(tf.distribute, "MultiWorkerMirroredStrategy",
                      lambda communication_options: seen.update(options=communication_options))
  config = config_defaults.base_config()
  config.strategy, config.peer_timeout_s = "multi_worker_mirrored", 15
  config.collective_timeout_s = collective_timeout_s
  strategies.create_strategy(config)
  assert seen["arrival"] == 15.0
  assert seen["options"].timeout_seconds == expected


def test_collective_timeout_default_is_none_and_negative_is_refused_with_one_line():
  config = config_defaults.base_config()
  assert config.collective_timeout_s == 0
  validation.validate(config)
  config.collective_timeout_s = -1
  with pytest.raises(validation.ConfigError) as raised:
    validation.validate(config)
  assert str(raised.value) == "`collective_timeout_s`=-1 must be a number >= 0"
