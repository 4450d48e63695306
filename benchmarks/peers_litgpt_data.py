"""A litgpt DataModule over a ``.npy`` token array of ``[rows, seq + 1]``: how bench_peers.py feeds
`litgpt pretrain` the same tokens apr reads from Parquet shards (``--data.class_path
peers_litgpt_data.TokenArray``, this folder on PYTHONPATH). Imported by litgpt's process only."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from litgpt.data import DataModule
from torch.utils.data import DataLoader


@dataclass
class TokenArray(DataModule):
    path: str = ""
    batch_size: int = field(default=1, init=False, repr=False)

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int = -1) -> None:
        self.batch_size = batch_size

    def _rows(self) -> torch.Tensor:
        return torch.from_numpy(np.load(self.path).astype(np.int64))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._rows(), batch_size=self.batch_size, shuffle=False, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._rows()[: 2 * self.batch_size], batch_size=self.batch_size, drop_last=True)
