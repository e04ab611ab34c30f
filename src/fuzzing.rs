//! Entry points of the fuzz targets (`fuzz/`, `scripts/fuzz`): every decoder that takes bytes
//! from the wire, each with the properties it must keep. Built with the `fuzzing` feature only.
//! A panic here is a finding.

use crate::agent::metadata::AgentMetadata;
use crate::agent::sidechannel;
use crate::agent::ClusterKey;

/// Metadata blobs: the body's parser (past the tag, which no fuzzer forges), then the whole
/// decoder. What decodes must encode again to a blob that decodes to the same value.
pub fn metadata(data: &[u8]) {
    let key = ClusterKey::from_bytes(b"the fuzz targets' fixed cluster key").expect("a valid key");
    if let Ok(md) = AgentMetadata::decode_untagged(data) {
        let blob = md.encode(&key).expect("decoded metadata encodes");
        let back = AgentMetadata::decode(&blob, &key).expect("its own blob decodes");
        assert_eq!(back, md, "metadata round trip");
    }
    // No fuzzer forges the tag: the whole decoder refuses what the body's parser was given.
    let _ = AgentMetadata::decode(data, &key);
}

/// Side-channel lines, as either side reads them.
pub fn side_channel(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for line in text.split('\n') {
        if let Some((name, _)) = sidechannel::parse_hello(line) {
            assert!(!name.is_empty() && !name.contains(' '));
        }
        let _ = sidechannel::parse_challenge(line);
        let (_, rest) = sidechannel::split_proof(line);
        let _ = sidechannel::parse_request(rest);
    }
}

/// A peer's queue pair endpoint (the CONNECT request and reply).
pub fn endpoint(data: &[u8]) {
    if let Ok(ep) = crate::verbs::Endpoint::from_bytes(data) {
        let again = crate::verbs::Endpoint::from_bytes(&ep.to_bytes()).expect("round trip");
        assert_eq!(again.to_bytes(), ep.to_bytes());
    }
}

/// A CUDA IPC handle from a peer's metadata.
pub fn ipc_handle(data: &[u8]) {
    if let Ok(h) = crate::nvlink::ipc::IpcHandle::from_bytes(data) {
        assert_eq!(h.0.as_slice(), data);
    }
}

/// Grant keys from a `CONNECT` or `GRANTS` reply: what decodes encodes to the same bytes
/// (one key per region, in region order).
pub fn grant_keys(data: &[u8]) {
    if let Ok(keys) = crate::agent::grants::GrantKeys::decode(data) {
        let again = keys.encode();
        let back = crate::agent::grants::GrantKeys::decode(&again).expect("its own bytes decode");
        assert_eq!(back, keys, "grant keys round trip");
    }
}
