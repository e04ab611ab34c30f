//! Unit tests of the FILE tier's planning (merging, splitting, alignment).

use super::*;

fn d(offset: u64, len: u64) -> FileDesc {
    FileDesc::new(offset, len)
}

#[test]
fn adjacent_descriptors_merge_and_long_ones_split() {
    let mut merged = 0;
    let ios = plan_ios(
        &[d(0, 4096), d(4096, 4096), d(8192, 4096), d(65536, 4096)],
        1 << 20,
        &mut merged,
    );
    assert_eq!(merged, 2);
    assert_eq!(
        ios,
        vec![
            Io {
                offset: 0,
                len: 12288,
                stream: 0,
                first_desc: 0
            },
            Io {
                offset: 65536,
                len: 4096,
                stream: 12288,
                first_desc: 3
            },
        ]
    );
    let mut merged = 0;
    let ios = plan_ios(&[d(4096, 3 << 20)], 1 << 20, &mut merged);
    assert_eq!(ios.len(), 3);
    assert!(ios.iter().all(|io| io.len == 1 << 20));
    assert_eq!(ios[2].offset, 4096 + (2 << 20));
    assert_eq!(ios[2].stream, 2 << 20);
}

#[test]
fn merging_stops_at_max_io_and_continues_in_a_new_io() {
    let mut merged = 0;
    let ios = plan_ios(&[d(0, 3 << 19), d(3 << 19, 1 << 20)], 1 << 20, &mut merged);
    let lens: Vec<u64> = ios.iter().map(|i| i.len).collect();
    assert_eq!(lens, vec![1 << 20, 1 << 20, 1 << 19]);
    assert_eq!(
        ios.iter().map(|i| i.len).sum::<u64>(),
        (3 << 19) + (1 << 20)
    );
    // Stream positions stay contiguous.
    for w in ios.windows(2) {
        assert_eq!(w[0].stream + w[0].len, w[1].stream);
    }
}

#[test]
fn reversed_or_overlapping_descriptors_do_not_merge() {
    let mut merged = 0;
    let ios = plan_ios(
        &[d(8192, 4096), d(4096, 4096), d(4096, 4096)],
        1 << 20,
        &mut merged,
    );
    assert_eq!(merged, 0);
    assert_eq!(ios.len(), 3);
}

#[test]
fn file_ranges_are_checked() {
    assert_eq!(
        validate_file(&[d(0, 10), d(4090, 10)], 4096),
        Err(FileError::OutOfRange {
            index: 1,
            offset: 4090,
            len: 10,
            size: 4096
        }
        .into())
    );
    assert_eq!(
        validate_file(&[d(u64::MAX, 2)], u64::MAX),
        Err(FileError::OutOfRange {
            index: 0,
            offset: u64::MAX,
            len: 2,
            size: u64::MAX
        }
        .into())
    );
    assert_eq!(
        validate_file(&[], 10),
        Err(InvalidDescriptor::Empty { side: "file" }.into())
    );
    assert_eq!(
        validate_file(&[d(0, 0)], 10),
        Err(InvalidDescriptor::ZeroLength {
            side: "file",
            index: 0
        }
        .into())
    );
    assert_eq!(validate_file(&[d(0, 10), d(20, 5)], 4096), Ok(15));
}
