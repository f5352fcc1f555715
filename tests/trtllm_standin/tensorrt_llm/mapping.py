"""tensorrt_llm/mapping.py: ranks of a TP x PP layout (no context parallelism here: cp_size 1)."""

import torch


class Mapping:
    def __init__(self, world_size=1, rank=0, tp_size=1, pp_size=1, cp_size=1, moe_tp_size=-1, moe_ep_size=-1, **_):
        if world_size != tp_size * pp_size * cp_size:
            raise ValueError(f"world_size must equal tp_size*pp_size*cp_size, got {world_size}, {tp_size}, {pp_size}")
        self.world_size, self.tp_size, self.pp_size, self.cp_size = world_size, tp_size, pp_size, cp_size
        self.moe_tp_size, self.moe_ep_size = moe_tp_size, moe_ep_size
        self.rank = rank

    @property
    def rank(self):
        return self._rank

    @rank.setter
    def rank(self, rank):
        self._rank = rank
        self.tp_rank = rank % self.tp_size
        self.pp_rank = rank // (self.tp_size * self.cp_size)

    def is_first_pp_rank(self):
        return self.pp_rank == 0

    def is_last_pp_rank(self):
        return self.pp_rank == self.pp_size - 1

    def prev_pp_rank(self):
        return self.rank - self.tp_size * self.cp_size

    def next_pp_rank(self):
        return self.rank + self.tp_size * self.cp_size

    def pp_layers(self, num_layers):
        return torch.tensor_split(torch.arange(num_layers), self.pp_size)[self.pp_rank].tolist()

    @classmethod
    def from_dict(cls, config):
        return cls(**config)

    def to_dict(self):
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "cp_size": self.cp_size,
            "moe_tp_size": self.moe_tp_size,
            "moe_ep_size": self.moe_ep_size,
        }
