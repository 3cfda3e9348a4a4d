"""Exact big-batch gradients for losses over the whole batch: gradient caching, across replicas.

A `BatchLossTask`'s loss L(r_1 .. r_N) couples every example of the update (in-batch negatives,
batch-hard mining, a histogram), so the sum of micro-batch gradients is not ∇L. Gradient
caching (Gao et al., 2021) makes it exact at micro-batch memory: L is differentiated with
respect to the representations only, and each micro-batch's forward is redone under a tape
with those gradients as output gradients. `config.accumulation.mode = "gradcache"`:

    update (replica context, every replica; the k micro-batches of the update as inputs)
      pass 1, no tape:  for m < k (tf.while_loop): r[m] = represent(batch m)    [k, b, ...]
      ONE all_gather:   R = r of every replica, in stream order                  [k·R·b, ...]
      loss gradient:    L = batch_loss(R); dL/dR; keep this replica's rows       (every replica
                                                                                  computes L)
      pass 2, tape:     for m < k (tf.while_loop):
                          buffers += ∂represent(batch m)/∂θ applied to dL/dr[m]  (SyncOnRead)
    then the usual update: ONE packed all-reduce, clip once, apply or skip on every replica.

Replica 0 alone reports L and a weight of 1, so that the all-reduced gradient, divided by the
reduced weight, is exactly ∇L. Random layers draw the same masks in both passes: before every
micro-batch forward, `seeded` sets each Keras SeedGenerator of the model to a state that depends
on (config.seed, generator, update, micro-step, replica) only. Collectives per update: one
all_gather (the update's representations and per-example fields, packed as float32) and one
packed all-reduce. Memory:
one micro-batch's activations at a time, plus the update's inputs (kept for pass 2) and its
representations. Traced, replica context, inside `strategy.run`.
"""
import tensorflow as tf

from trainer import accumulation
from trainer import autograph
from trainer import base_task
from trainer import loss_call
from trainer import replica_state
from trainer import sources


def seeded(states, seed: int, update, micro_step, replica, num_replicas: int,
           micro_steps: int) -> None:
  """Sets every SeedGenerator to a state that depends only on (seed, generator, update,
  micro-step, replica): the same masks wherever and however often that micro-batch runs."""
  counter = ((tf.cast(update, tf.int64) * micro_steps + tf.cast(micro_step, tf.int64))
             * num_replicas + tf.cast(replica, tf.int64))
  for index, state in enumerate(states):
    base = tf.constant(seed * 7919 + index, tf.int64)  # Distinct per generator (layer).
    state.assign(tf.cast(tf.stack([base, counter]), state.dtype))


def _as_words(t):
  """A field as float32 words for the packed all_gather, and their count per example.

  Floats are cast to float32 (and stay float32 after the gather: the loss gradient is formed
  there, before any loss scale). Integers and bools travel bit for bit: as int64, bitcast to two
  float32 words (a float32 cast would round labels above 2^24); a gather only copies them.
  """
  if t.dtype.is_floating:
    return tf.cast(t, tf.float32), 1
  words = tf.bitcast(tf.bitcast(tf.cast(t, tf.int64), tf.int32), tf.float32)  # [..., 2]
  return words, 2


def _pack(fields: dict):
  """[k, b, ...] fields -> one float32 [k, b, F] tensor, and how to unpack it."""
  names = sorted(fields)
  layout, flat = [], []
  for name in names:
    words, per_value = _as_words(fields[name])
    layout.append((name, fields[name].dtype, fields[name].shape[2:], per_value))
    flat.append(tf.reshape(words, tf.concat([tf.shape(words)[:2], [-1]], 0)))
  return tf.concat(flat, axis=2), layout


def _unpack(packed, layout) -> dict:
  """Inverse of `_pack`: floats come back as float32, integers with their own dtype."""
  sizes = [int(shape.num_elements()) * per_value for _, _, shape, per_value in layout]
  out = {}
  for (name, dtype, shape, per_value), part in zip(layout, tf.split(packed, sizes, axis=2)):
    lead = tf.shape(part)[:2]
    if per_value == 1:
      out[name] = tf.reshape(part, tf.concat([lead, shape], 0))
    else:
      words = tf.reshape(part, tf.concat([lead, shape, [2]], 0))
      out[name] = tf.cast(tf.bitcast(tf.bitcast(words, tf.int32), tf.int64), dtype)
  return out


def _differentiable(fields: dict) -> list:
  return sorted(n for n, t in fields.items() if t.dtype.is_floating)


class GradCache:
  """The two-pass accumulation of one trainer; built eagerly, used traced (module docstring)."""

  def __init__(self, task, model, *, micro_steps: int, num_replicas: int, seed: int):
    self.task, self.model = task, model
    self.micro_steps, self.num_replicas, self.seed = micro_steps, num_replicas, seed
    self._states = (replica_state.seed_states(model)
                    + replica_state.task_seed_states(task, model))

  def _represent(self, batch, update, micro_step, replica):
    seeded(self._states, self.seed, update, micro_step, replica, self.num_replicas,
           self.micro_steps)
    features = {k: v for k, v in batch.items() if k != sources.VALID_KEY}
    with loss_call.in_a_name_scope("represent"):
      return autograph.task_code(self.task.represent)(self.model, features, training=True)

  def accumulate(self, batches, buffers, update, loss_scale=None, reached=None):
    """Both passes over this replica's k micro-batches; adds ∇L's share into `buffers`.

    `reached` (a `trainer.update.ReachedVariables`) learns, while tracing, which variables the
    loss reaches.

    Returns this replica's scalar sums [L, weight, metrics...] (zeros except on replica 0).
    """
    ctx = tf.distribute.get_replica_context()
    replica = ctx.replica_id_in_sync_group
    stacked = tf.nest.map_structure(lambda *parts: tf.stack(parts), *batches)
    take = lambda m: tf.nest.map_structure(lambda t: t[m], stacked)
    k = self.micro_steps

    # Pass 1: representations only, no tape; one micro-batch's activations at a time.
    first = self._represent(take(0), update, 0, replica)
    arrays = {n: tf.TensorArray(t.dtype, size=k, element_shape=t.shape).write(0, t)
              for n, t in first.items()}
    def represent_one(m, arrays):
      reps = self._represent(take(m), update, m, replica)
      return m + 1, {n: arrays[n].write(m, reps[n]) for n in arrays}
    _, arrays = tf.while_loop(lambda m, _: m < k, represent_one, (tf.constant(1), arrays),
                              maximum_iterations=k - 1)
    local = {n: a.stack() for n, a in arrays.items()}                     # [k, b, ...]

    # The whole update's representations, stream order: micro-step-major, then replica.
    packed, layout = _pack(local)
    gathered = _unpack(ctx.all_gather(packed, axis=1), layout)            # [k, R·b, ...]
    everything = {n: tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], 0))
                  for n, t in gathered.items()}                           # [k·R·b, ...]
    differentiable = _differentiable(everything)
    with tf.GradientTape() as tape:
      tape.watch([everything[n] for n in differentiable])
      out = base_task.batch_loss_of(self.task, everything,
                                    tf.ones(tf.shape(everything[differentiable[0]])[:1]))
      loss = tf.cast(out.loss, tf.float32)
    row_grads = tape.gradient(loss, [everything[n] for n in differentiable],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
    per_replica = tf.shape(local[differentiable[0]])[1]
    start = tf.cast(replica, tf.int32) * per_replica
    mine = {}
    for name, grad in zip(differentiable, row_grads):
      grid = tf.reshape(grad, tf.shape(gathered[name]))                  # [k, R·b, ...]
      mine[name] = grid[:, start:start + per_replica]                    # this replica's rows
      if loss_scale is not None:
        mine[name] *= tf.cast(loss_scale, mine[name].dtype)

    # Pass 2: each micro-batch again, under a tape, pushing dL/dr[m] into the buffers.
    variables = self.model.trainable_variables
    zeros = tf.zeros(buffers.scalars.shape, tf.float32)
    def backward_one(m):
      with tf.GradientTape() as tape:
        reps = self._represent(take(m), update, m, replica)
      grads = tape.gradient([reps[n] for n in differentiable], variables,
                            output_gradients=[tf.cast(mine[n][m], reps[n].dtype)
                                              for n in differentiable])
      if reached is not None:
        reached.note(g is not None for g in grads)
      buffers.add([accumulation.dense_float32(g, v) for g, v in zip(grads, variables)], zeros)
      return m + 1
    tf.while_loop(lambda m: m < k, backward_one, [tf.constant(0)], maximum_iterations=k)

    first_replica = tf.cast(tf.equal(replica, 0), tf.float32)
    metrics = [tf.cast(out.metrics[name], tf.float32) for name in self.task.metric_names]
    return tf.stack([loss, 1.0] + metrics) * first_replica
