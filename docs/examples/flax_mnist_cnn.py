"""The CNN of Flax's MNIST tutorial (docs_nnx/mnist_tutorial.md), trained by jaxpar.

    jaxpar train --recipe flax_mnist_cnn:recipe --mesh fsdp8     # from this folder

Flax's text (its imports, the CNN, the optimizer settings and loss_fn), then what jaxpar needs:
a model config with build(rngs) and a recipe. `jaxpar docs guide_own_model` shows the diff.
"""

from flax import nnx  # The Flax NNX API.
from functools import partial
from typing import Optional

class CNN(nnx.Module):
  """A simple CNN model."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.025)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
    self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(256, 256, rngs=rngs)  # 8x8 digits: 2*2*64 features
    self.dropout2 = nnx.Dropout(rate=0.025)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)  # flatten
    x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
    x = self.linear2(x)
    return x

import optax
learning_rate = 0.005
momentum = 0.9

def loss_fn(model: CNN, batch, rngs: nnx.Rngs | None = None):
  logits = model(batch['image'], rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(
    logits=logits, labels=batch['label']
  ).mean()
  return loss, {'accuracy': (logits.argmax(-1) == batch['label']).mean()}


# --- jaxpar ---------------------------------------------------------------------------------------
from dataclasses import dataclass

import jaxpar


@dataclass(frozen=True)
class CNNConfig:
  def build(self, rngs: nnx.Rngs) -> CNN:
    return CNN(rngs=rngs)


def recipe() -> jaxpar.TrainConfig:
  return jaxpar.TrainConfig(
    name='flax_mnist_cnn',
    model=CNNConfig(),
    data=jaxpar.DataConfig(source='digits', global_batch=32),
    loss=loss_fn,
    optimizer=optax.adamw(learning_rate, momentum),
    train=jaxpar.TrainLoopConfig(steps=1200, eval_every=200),
  )
