"""Flax's miniGPT example (docs_nnx/examples/minigpt.md), trained by jaxpar.

    jaxpar train --recipe flax_minigpt:recipe --mesh dp2_tp4     # from this folder

Flax's text (its imports, the model, the hyperparameters), then what jaxpar needs: a model
config with build(rngs) and a recipe whose rule puts the example's 'model' axis on jaxpar's
`tensor` mesh axis. `jaxpar docs guide_own_model` shows the diff.
"""

import jax
import jax.numpy as jnp

import flax.nnx as nnx
import optax

from dataclasses import dataclass
from jax.sharding import PartitionSpec as P, reshard
import time

class TransformerBlock(nnx.Module):
    """ A single Transformer block.

    Each Transformer block processes input sequences via self-attention and feed-forward networks.

    Args:
        embed_dim (int): Embedding dimensionality.
        num_heads (int): Number of attention heads.
        ff_dim (int): Dimensionality of the feed-forward network.
        rngs (flax.nnx.Rngs): A Flax NNX stream of JAX PRNG keys.
        rate (float): Dropout rate. Defaults to 0.1.
    """
    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, *, rngs: nnx.Rngs, rate: float = 0.1):
        self.mha = nnx.MultiHeadAttention(num_heads=num_heads,
              in_features=embed_dim,
              kernel_metadata={'out_sharding': P(None, 'model')},
              bias_metadata={'out_sharding': P('model')},
              rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=rate, rngs=rngs)
        self.layer_norm1 = nnx.LayerNorm(epsilon=1e-6,
             num_features=embed_dim,
             scale_metadata={'out_sharding': P('model')},
             bias_metadata={'out_sharding': P('model')},
             rngs=rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(in_features=embed_dim,
              out_features=ff_dim,
              kernel_metadata={'out_sharding': P(None, 'model')},
              bias_metadata={'out_sharding': P('model')},
              rngs=rngs),
            nnx.relu, 
            nnx.Linear(in_features=ff_dim,
              out_features=embed_dim,
              kernel_metadata={'out_sharding': P(None, 'model')},
              bias_metadata={'out_sharding': P('model')},
              rngs=rngs),
            nnx.Dropout(rate=rate, rngs=rngs))
        self.layer_norm2 = nnx.LayerNorm(epsilon=1e-6,
         num_features=embed_dim,
         scale_metadata={'out_sharding': P('model')},
         bias_metadata={'out_sharding': P('model')},
         rngs=rngs)


    # Apply the Transformer block to the input sequence.
    def __call__(self, inputs):
        # Instantiate the causal attention mask.
        attention_output = self.mha(
            inputs_q=inputs,
            is_causal=True,
            decode=False
        )
        attention_output = self.dropout1(attention_output)
        out1 = self.layer_norm1(inputs + attention_output)
        ffn_output = self.mlp(out1)
        return self.layer_norm2(out1 + ffn_output)

class TokenAndPositionEmbedding(nnx.Module):
    """ Combines token embeddings (words in an input sentence) with
    positional embeddings (the position of each word in a sentence).

    Args:
        maxlen (int): Matimum sequence length.
        vocal_size (int): Vocabulary size.
        embed_dim (int): Embedding dimensionality.
        rngs (flax.nnx.Rngs): A Flax NNX stream of JAX PRNG keys.
    """
    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
        # Initialize token embeddings (using `flax.nnx.Embed`).
        # Each unique word has an embedding vector.
        self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
        # Initialize positional embeddings (using `flax.nnx.Embed`).
        self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

    # Takes a token sequence (integers) and returns the combined token and positional embeddings.
    def __call__(self, x):
        # Generate a sequence of positions for the input tokens.
        positions = jnp.arange(0, x.shape[1])[None, :]
        # Look up the positional embeddings for each position in the input sequence.
        position_embedding = self.pos_emb(positions)
        # Look up the token embeddings for each token in the input sequence.
        token_embedding = self.token_emb(x, out_sharding=jax.typeof(x).sharding)
        # Combine token and positional embeddings.
        return token_embedding + position_embedding

class MiniGPT(nnx.Module):
    """ A miniGPT transformer model, inherits from `flax.nnx.Module`.

    Args:
        maxlen (int): Maximum sequence length.
        vocab_size (int): Vocabulary size.
        embed_dim (int): Embedding dimensionality.
        num_heads (int): Number of attention heads.
        feed_forward_dim (int): Dimensionality of the feed-forward network.
        num_transformer_blocks (int): Number of transformer blocks. Each block contains attention and feed-forward networks.
        rngs (nnx.Rngs): A Flax NNX stream of JAX PRNG keys.
    """
    # Initialize miniGPT model components.
    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, num_heads: int, feed_forward_dim: int, num_transformer_blocks: int, rngs: nnx.Rngs):
        # Initiliaze the `TokenAndPositionEmbedding` that combines token and positional embeddings.
        self.embedding_layer = TokenAndPositionEmbedding(
                    maxlen, vocab_size, embed_dim, rngs=rngs
                )
        # Create a list of `TransformerBlock` instances.
        # Each block processes input sequences using attention and feed-forward networks.
        self.transformer_blocks = nnx.Sequential(*[TransformerBlock(
            embed_dim, num_heads, feed_forward_dim, rngs=rngs
        ) for _ in range(num_transformer_blocks)])
        # Initialize the output `flax.nnx.Linear` layer producing logits over the vocabulary for next-token prediction.
        self.output_layer = nnx.Linear(in_features=embed_dim,
                                       out_features=vocab_size,
                                       kernel_metadata={'out_sharding': P(None, 'model')},
                                       bias_metadata={'out_sharding': P('model')},
                                       rngs=rngs)

    def __call__(self, inputs):
        # Pass the input tokens through the `embedding_layer` to get token embeddings.
        x = self.embedding_layer(inputs)
        # Apply each transformer block sequentially to the embedded input
        x = self.transformer_blocks(x)
        # Pass the output of the transformer blocks through the output layer,
        # and obtain logits for each token in the vocabulary (for next token prediction).
        return reshard(self.output_layer(x), jax.typeof(inputs).sharding)

    def sample_from(self, logits):
        logits, indices = jax.lax.top_k(logits, k=top_k)
        logits = nnx.softmax(logits)
        return jax.random.choice(jax.random.PRNGKey(0), indices, p=logits)

    @nnx.jit(donate_argnums=(1,))
    def generate_step(self, padded_tokens, sample_index):
        logits = self(padded_tokens)
        next_token = self.sample_from(logits[0][sample_index])
        return next_token

    def generate_text(self, max_tokens, start_tokens):
        generated = []
        for i in range(max_tokens):
            sample_index = len(start_tokens) + len(generated) - 1

            padded_tokens = jnp.array((start_tokens + generated + [0] * (maxlen - len(start_tokens) - len(generated))))[None, :]
            next_token = int(self.generate_step(padded_tokens, sample_index))
            if next_token == tokenizer.encode('<|endoftext|>', allowed_special={'<|endoftext|>'})[0]:
              break
            generated.append(next_token)
        return tokenizer.decode(start_tokens + generated)

# Creates the miniGPT model with 4 transformer blocks.
def create_model(rngs):
    return MiniGPT(maxlen, vocab_size, embed_dim, num_heads, feed_forward_dim, num_transformer_blocks=4, rngs=rngs)

vocab_size = 256  # bytes of jaxpar's stdlib_text corpus
num_transformer_blocks = 8
maxlen = 256
embed_dim = 256
num_heads = 8
feed_forward_dim = 256
batch_size = 144
num_epochs = 1
top_k = 10


# --- jaxpar ---------------------------------------------------------------------------------------
import jaxpar


@dataclass(frozen=True)
class MiniGPTConfig:
    def build(self, rngs: nnx.Rngs) -> MiniGPT:
        return create_model(rngs)


def recipe() -> jaxpar.TrainConfig:
    return jaxpar.TrainConfig(
        name='flax_minigpt',
        model=MiniGPTConfig(),
        data=jaxpar.DataConfig(source='stdlib_text', global_batch=batch_size, seq_len=maxlen),
        optimizer=optax.adam(1e-3),
        rules=(('model', 'tensor'),),
        train=jaxpar.TrainLoopConfig(steps=1000, eval_every=200),
    )
