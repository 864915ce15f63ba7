"""The lengths suite's batch-1 case alone, as a table (``python -m bench --suite lengths`` runs
batch 1 and padded batches of 4)::

    PYTHONPATH=. python bench/lengths_batch1.py
"""
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
from bench import lengths, report
rows, fails = [], {}
lengths._case(lengths._config(True), 1, "cpu", rows, fails)
print(fails)
print(report.suite_table(rows, lengths.BASELINE, lengths.TABLE_METRICS))
