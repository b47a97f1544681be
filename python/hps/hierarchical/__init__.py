"""hps.hierarchical: Hierarchical Training (HT, KDD 2021) on hps's MPI layer.

HT replaces each data-parallel trainer by a group of nodes sharing one dense
replica; groups average with a centre in the background (EASGD), the heavy FC
layers are split over the group's parameter servers, and traffic is compressed.

The package by concern: :mod:`~hps.hierarchical.codecs` (bf16, int8 per row,
top-k with error feedback; bytes counted per traffic kind), :mod:`~hps.hierarchical.easgd`
(the elastic update between group replicas and a centre), :mod:`~hps.hierarchical.placement`
(a placement plan and its checks against the Linears' widths, without torch),
:mod:`~hps.hierarchical.split_mlp`
(an MLP's Linear layers placed on the trainer or split over the group PSs; torch,
imported from that module only), :mod:`~hps.hierarchical.planner` (the placement:
rules, then greedy refinement against the modelled bottleneck; ``hps plan``),
:mod:`~hps.hierarchical.roles` (groups, trainers, group PSs and the centre of an MPI
job, and ``hps train`` with them: :func:`~hps.hierarchical.roles.train_hierarchical`).
"""
from hps.hierarchical.codecs import (TRAFFIC_KINDS, BFloat16, ByteCounter, Codec, Encoded, Int8RowScale, NoCodec,
                                     TopK, make_codec)
from hps.hierarchical.easgd import Easgd, EasgdConfig

__all__ = ["TRAFFIC_KINDS", "BFloat16", "ByteCounter", "Codec", "Easgd", "EasgdConfig", "Encoded", "Int8RowScale",
           "NoCodec", "TopK", "make_codec"]
