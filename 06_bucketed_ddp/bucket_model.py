"""Stage 06, second idea: how big should a bucket be? An overhead model.

With total gradient bytes ``s``, all-reduce bandwidth ``w``, per-call overhead ``o`` and
``n_b`` equal buckets, and a bucket taking about as long to compute as to communicate, every
bucket but the last overlaps backward, and every call pays ``o``. What is left after
backward is about

    t(n_b) = n_b * o + s / (n_b * w),

smallest where its derivative o - s / (n_b^2 w) is zero: n_b = sqrt(s / (w o)) buckets, a
bucket size of s / n_b = sqrt(s w o). Stage 02 measures ``o`` (its fitted latency ``a``) and
``w`` on your machine. Worked example (the README sets it beside a measured sweep): the course
LM's 77 MiB (80 MB) of gradients, o = 1 ms and w = 1 GB/s give n_b = 9 buckets of 8.5 MiB. Needs only
the standard library.
"""

import math


def comm_after_backward_model(n_buckets: float, total_bytes: float, o_s: float,
                              w_bytes_per_s: float) -> float:
    """Seconds of communication left after backward with ``n_buckets`` equal buckets."""
    return n_buckets * o_s + total_bytes / (n_buckets * w_bytes_per_s)


def best_bucket_size_bytes(total_bytes: float, o_s: float,
                           w_bytes_per_s: float) -> tuple[float, float]:
    """(best bucket size in bytes, best number of buckets): sqrt(s w o) and sqrt(s / (w o))."""
    return (math.sqrt(total_bytes * w_bytes_per_s * o_s),
            math.sqrt(total_bytes / (w_bytes_per_s * o_s)))
