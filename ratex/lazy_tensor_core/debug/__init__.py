"""`ratex.lazy_tensor_core.debug`: counters and timers (`metrics`), under the path Ratex users import."""
