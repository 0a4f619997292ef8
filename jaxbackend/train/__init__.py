"""`jaxbackend.train`: the main job. Data (`stdlib` source as chars, or your
text), the loop (AdamW, jit, eval, sampling; the GPT or your own model and
loss), orbax checkpoints (per shard, asynchronous, the newest N kept), loss
plots and the `python -m jaxbackend train` command (`_cli.main`)."""

from jaxbackend.train._checkpoint import CheckpointError as CheckpointError
from jaxbackend.train._checkpoint import Checkpointer as Checkpointer
from jaxbackend.train._checkpoint import load as load_checkpoint
from jaxbackend.train._checkpoint import save as save_checkpoint
from jaxbackend.train._data import as_ids as as_ids
from jaxbackend.train._data import decode as decode
from jaxbackend.train._data import encode as encode
from jaxbackend.train._data import get_batch as get_batch
from jaxbackend.train._data import load_corpus as load_corpus
from jaxbackend.train._data import load_text as load_text
from jaxbackend.train._data import split as split
from jaxbackend.train._data import unigram_baseline as unigram_baseline
from jaxbackend.train._loop import TrainConfig as TrainConfig
from jaxbackend.train._loop import train as train
from jaxbackend.train._plots import loss_curve as loss_curve

__all__ = ["CheckpointError", "Checkpointer", "TrainConfig", "as_ids", "decode", "encode", "get_batch",
           "load_checkpoint", "load_corpus", "load_text", "loss_curve", "save_checkpoint", "split",
           "train", "unigram_baseline"]
