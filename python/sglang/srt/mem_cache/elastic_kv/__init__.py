"""Elastic KV pages (issue 15): shrink and grow the KV token pool at a scheduler safe point
with requests in flight; ``resize.ElasticKV`` is the mechanism, ``backing`` the reserved host
memory, ``tree_values`` the radix tree's KV indices, ``accounting`` the leak check."""
