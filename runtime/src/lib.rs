#![forbid(unsafe_code)]
//! `rixl-runtime`: thread-per-core engines turning RDMA completions into futures.
