"""`ratex.lazy_tensor_core.core`: the model API (`lazy_model`), under the path Ratex users import."""
