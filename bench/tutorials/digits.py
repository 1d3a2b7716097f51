"""bench/tutorials/digits.py: the digits split of scripts/examples/common/digits.lua
(python3-sklearn's digits.csv.gz; every fifth sample is the test set; pixels / 16,
normalised with the training set's mean and std; labels 0..9)."""
import gzip

import numpy as np
import torch

PATH = "/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz"


def load(path=PATH):
    with gzip.open(path, "rt") as f:
        a = np.loadtxt(f, delimiter=",", dtype=np.float32)
    test = np.arange(len(a)) % 5 == 0
    x = torch.from_numpy(a[:, :64] / 16).view(-1, 1, 8, 8)
    y = torch.from_numpy(a[:, 64].astype(np.int64))
    tr, te = torch.from_numpy(~test), torch.from_numpy(test)
    mean, std = x[tr].mean().item(), x[tr].std().item()
    x = (x - mean) / std
    return (x[tr], y[tr]), (x[te], y[te])
