"""PNG figures of an LSM run: input/reservoir spike raster, the confusion matrix, accuracy and
energy per precision."""

from __future__ import annotations

import numpy as np

from omni_jax.common.figures import pyplot, save_figure

plt = pyplot()


def _save(fig, path: str) -> None:
  save_figure(fig, path, dpi=110, bbox_inches="tight")


def raster(path: str, in_spikes: np.ndarray, res_spikes: np.ndarray, inhibitory: np.ndarray,
           title: str, step: str = "1 ms") -> None:
  """Input (T, C) and reservoir (T, N) spikes of one utterance, inhibitory neurons in red;
  ``step`` names what one time step is."""
  fig, ax = plt.subplots(2, 1, figsize=(9, 6), sharex=True,
                         gridspec_kw={"height_ratios": [1, 1.6]})
  t, c = np.nonzero(in_spikes)
  ax[0].scatter(t, c, s=1, c="k")
  ax[0].set_ylabel("input channel")
  ax[0].set_title(title)
  t, n = np.nonzero(res_spikes)
  ax[1].scatter(t, n, s=1, c=np.where(inhibitory[n], "tab:red", "tab:blue"))
  ax[1].set_ylabel("reservoir neuron")
  ax[1].set_xlabel(f"time step ({step})")
  _save(fig, path)


def confusion(path: str, cm: np.ndarray, labels: tuple, title: str) -> None:
  """Row-normalised confusion matrix with counts printed in the cells."""
  fig, ax = plt.subplots(figsize=(6, 5))
  norm = cm / np.maximum(cm.sum(1, keepdims=True), 1)
  ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
  for i in range(cm.shape[0]):
    for j in range(cm.shape[1]):
      if cm[i, j]:
        ax.text(j, i, int(cm[i, j]), ha="center", va="center", fontsize=7,
                color="white" if norm[i, j] > 0.5 else "black")
  ax.set_xticks(range(len(labels)), labels, rotation=45)
  ax.set_yticks(range(len(labels)), labels)
  ax.set_xlabel("predicted")
  ax.set_ylabel("true")
  ax.set_title(title)
  _save(fig, path)


def precision(path: str, names: list, acc_val: dict, acc_test: dict, energy_rel: list,
              title: str) -> None:
  """Accuracy (validation, test) and modelled energy relative to the reference, per
  precision."""
  fig, ax = plt.subplots(1, 2, figsize=(9, 3.6))
  x = np.arange(len(names))
  ax[0].bar(x - 0.2, [acc_val[n] for n in names], 0.4, label="validation")
  ax[0].bar(x + 0.2, [acc_test[n] for n in names], 0.4, label="test")
  lo = min(min(acc_val.values()), min(acc_test.values()))
  ax[0].set_ylim(max(0.0, lo - 0.05), 1.0)
  ax[0].set_xticks(x, names)
  ax[0].set_xlabel("precision (bits; membrane/weight/calcium)")
  ax[0].set_ylabel("accuracy")
  ax[0].legend(bbox_to_anchor=(0.0, 1.0), loc="lower left", ncol=2, frameon=False)
  ax[1].bar(x, energy_rel, 0.6, color="tab:green")
  ax[1].set_xticks(x, names)
  ax[1].set_xlabel("precision")
  ax[1].set_ylabel("energy / ungated reference (modelled)")
  ax[1].set_ylim(0, 1.05)
  fig.suptitle(title)
  _save(fig, path)
