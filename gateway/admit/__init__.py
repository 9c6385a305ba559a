"""The one admit step both front ends run on a request before it reaches a replica
(`admission.py`): who the caller is and what its API key allows (`auth.py`), what an
inference gateway's headers say about tenant and tier (`routing_headers.py`), then
gateway/validation.py; `parse_guard.py` makes anything parsing raises that no check
foresaw a 400 rather than a 500.
"""
