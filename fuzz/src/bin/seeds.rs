//! Writes the seed inputs of every target into `corpus/<target>/` (run once; the fuzzer's
//! finds are added next to them by `scripts/fuzz --keep`).
use std::path::Path;

use rixl::agent::metadata::{AgentMetadata, IpcExport, MemKind, RegionInfo};
use rixl::agent::ClusterKey;

fn write(dir: &Path, target: &str, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let d = dir.join(target);
    std::fs::create_dir_all(&d)?;
    std::fs::write(d.join(name), bytes)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let key = ClusterKey::from_bytes(b"the fuzz targets' fixed cluster key")?;
    let region = |id: u64, kind| RegionInfo {
        id,
        addr: 0x7f00_0000_0000 + (id << 20),
        len: 1 << 20,
        rkey: 0x100 + id as u32,
        kind,
        rail_rkeys: [0x200 + id as u32, 0, 0, 0, 0, 0, 0],
        bound: 0b01,
    };
    let full = AgentMetadata {
        name: "prefill-0".into(),
        generation: 7,
        address: "10.0.0.1:7000".into(),
        regions: vec![region(1, MemKind::Dram), region(2, MemKind::Vram)],
        rails: 2,
        node: "boot/host".into(),
        process: 42,
        ipc: vec![IpcExport {
            region: 2,
            gpu: 0,
            handle: [9; 64],
        }],
        partial: false,
        removed: vec![],
        grants: true,
        nic: true,
    };
    let partial = AgentMetadata {
        partial: true,
        regions: vec![region(3, MemKind::Dram)],
        ipc: vec![],
        removed: vec![1, 2],
        rails: 1,
        ..full.clone()
    };
    write(&dir, "metadata", "full", &full.encode(&key)?)?;
    write(&dir, "metadata", "partial", &partial.encode(&key)?)?;
    let nonce = "ab".repeat(32);
    let proof = "cd".repeat(32);
    let lines = [
        ("hello", format!("RIXL1 HELLO prefill-0 {nonce}\n")),
        (
            "challenge",
            format!("RIXL1 CHALLENGE decode-1 {nonce} {proof}\n"),
        ),
        ("md", format!("{proof} MD\n")),
        (
            "connect",
            format!("{proof} CONNECT {} 0 12345\n", "00".repeat(27)),
        ),
        ("grants", format!("{proof} GRANTS 0 17\n")),
        ("err", "ERR authentication failed\n".to_string()),
    ];
    for (name, l) in lines {
        write(&dir, "side_channel", name, l.as_bytes())?;
    }
    write(&dir, "endpoint", "zeros", &[0u8; 27])?;
    write(&dir, "endpoint", "ones", &[1u8; 27])?;
    write(&dir, "ipc_handle", "handle", &[7u8; 64])?;
    // count u32, then (region u64, rkey u32) per key, big-endian.
    let mut keys = 2u32.to_be_bytes().to_vec();
    for (region, rkey) in [(1u64, 0x100u32), (7, 0x2ff)] {
        keys.extend_from_slice(&region.to_be_bytes());
        keys.extend_from_slice(&rkey.to_be_bytes());
    }
    write(&dir, "grant_keys", "two", &keys)?;
    write(&dir, "grant_keys", "none", &0u32.to_be_bytes())?;
    println!("seeds written under {}", dir.display());
    Ok(())
}
