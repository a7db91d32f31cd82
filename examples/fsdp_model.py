"""A small decoder-only transformer in Flax (linen), with no distribution in it.

RMSNorm, rotary position embeddings, causal multi-head attention and a SwiGLU MLP,
pre-norm residual blocks. The model is three modules used separately, so that the
FSDP code can gather one piece's parameters just before using it:

  Embed  tokens -> activations              (params gathered once per step)
  Block  one transformer layer              (params stacked over layers, scanned)
  Head   final RMSNorm + output projection  (params gathered once per step)

`forward` composes them for an ordinary unsharded run; fsdp.py composes them with
parameter gathers inside `jax.shard_map`.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 256
  d_model: int = 128
  n_heads: int = 4
  n_layers: int = 4
  d_ff: int = 352          # SwiGLU hidden width (about 8/3 d_model)
  seq_len: int = 128
  rope_base: float = 10000.0

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads


def _dense(features: int, name: str, scale: float = 1.0) -> nn.Dense:
  return nn.Dense(features, use_bias=False, name=name,
                  kernel_init=nn.initializers.normal(0.02 * scale))


class RMSNorm(nn.Module):
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * scale).astype(x.dtype)


def rotary(x, base: float):
  """Rotary position embedding (half-split form) over x: [batch, seq, heads, head_dim]."""
  seq, dim = x.shape[1], x.shape[-1]
  inv_freq = base ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
  angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  sin = jnp.sin(angles)[None, :, None, :]
  cos = jnp.cos(angles)[None, :, None, :]
  x1, x2 = x[..., :dim // 2], x[..., dim // 2:]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class CausalAttention(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    b, t, _ = x.shape
    split = lambda y: y.reshape(b, t, cfg.n_heads, cfg.head_dim)
    q = rotary(split(_dense(cfg.d_model, "wq")(x)), cfg.rope_base)
    k = rotary(split(_dense(cfg.d_model, "wk")(x)), cfg.rope_base)
    v = split(_dense(cfg.d_model, "wv")(x))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(cfg.head_dim).astype(x.dtype)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal[None, None], scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, cfg.d_model)
    return _dense(cfg.d_model, "wo", scale=(2 * cfg.n_layers) ** -0.5)(out)


class SwiGLU(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    hidden = nn.silu(_dense(cfg.d_ff, "w_gate")(x)) * _dense(cfg.d_ff, "w_up")(x)
    return _dense(cfg.d_model, "w_down", scale=(2 * cfg.n_layers) ** -0.5)(hidden)


class Block(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, x):
    x = x + CausalAttention(self.cfg, name="attn")(RMSNorm(name="attn_norm")(x))
    return x + SwiGLU(self.cfg, name="mlp")(RMSNorm(name="mlp_norm")(x))


class Embed(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, tokens):
    return nn.Embed(self.cfg.vocab, self.cfg.d_model, name="tok",
                    embedding_init=nn.initializers.normal(0.02))(tokens)


class Head(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, x):
    return _dense(self.cfg.vocab, "out")(RMSNorm(name="norm")(x))


def init_params(cfg: Config, key) -> dict:
  """Unsharded parameters: {"embed": ..., "layers": (stacked over layers), "head": ...}."""
  k_embed, k_layers, k_head = jax.random.split(key, 3)
  tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
  x = jnp.zeros((1, cfg.seq_len, cfg.d_model), jnp.float32)
  layer_keys = jax.random.split(k_layers, cfg.n_layers)
  return {
      "embed": Embed(cfg).init(k_embed, tokens)["params"],
      "layers": jax.vmap(lambda k: Block(cfg).init(k, x)["params"])(layer_keys),
      "head": Head(cfg).init(k_head, x)["params"],
  }


def next_token_loss_sum(logits, targets):
  """Sum (not mean) of next-token cross-entropy, in float32."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def forward(cfg: Config, params: dict, tokens):
  """Unsharded forward pass: logits for `tokens` [batch, seq]."""
  x = Embed(cfg).apply({"params": params["embed"]}, tokens)
  x, _ = jax.lax.scan(lambda h, p: (Block(cfg).apply({"params": p}, h), None),
                      x, params["layers"])
  return Head(cfg).apply({"params": params["head"]}, x)
