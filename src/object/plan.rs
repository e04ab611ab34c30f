//! Pure planning of an OBJECT transfer: descriptors grouped by object, checked, and cut into
//! requests of at most one part, each paired with the local memory it fills or empties.

use super::error::ObjectError;
use super::ObjectDesc;

/// A run of one object's bytes: `len` bytes at `offset` of the object, which are bytes
/// `stream..stream+len` of the local list read in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Segment {
    pub index: usize,
    pub offset: u64,
    pub len: u64,
    pub stream: u64,
}

/// The descriptors of one object, in list order (runs adjacent in both the object and the
/// local list merged).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ObjectPlan {
    pub key: String,
    pub location: object_store::path::Path,
    pub segments: Vec<Segment>,
}

impl ObjectPlan {
    /// Bytes of the object the transfer moves.
    pub fn bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.len).sum()
    }
}

/// One request's worth of an object: `len` bytes at `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Range {
    pub offset: u64,
    pub len: u64,
    pub stream: u64,
}

/// Groups `descs` by key, in order of first appearance, and checks them against `prefix`
/// (the registration's). The local list was already checked, and its length equals the
/// descriptors'.
///
/// # Errors
/// [`ObjectError::InvalidKey`].
pub(crate) fn group(
    prefix: &object_store::path::Path,
    descs: &[ObjectDesc],
) -> Result<Vec<ObjectPlan>, ObjectError> {
    let mut plans: Vec<ObjectPlan> = Vec::new();
    let mut stream = 0u64;
    for (index, d) in descs.iter().enumerate() {
        let at = match plans.iter().position(|p| p.key == d.key) {
            Some(i) => i,
            None => {
                let location =
                    location(prefix, &d.key).map_err(|source| ObjectError::InvalidKey {
                        index,
                        key: d.key.clone(),
                        source,
                    })?;
                plans.push(ObjectPlan {
                    key: d.key.clone(),
                    location,
                    segments: Vec::new(),
                });
                plans.len() - 1
            }
        };
        let segs = &mut plans[at].segments;
        match segs.last_mut() {
            Some(last)
                if last.offset.checked_add(last.len) == Some(d.offset)
                    && last.stream + last.len == stream =>
            {
                last.len += d.len;
            }
            _ => segs.push(Segment {
                index,
                offset: d.offset,
                len: d.len,
                stream,
            }),
        }
        stream += d.len;
    }
    Ok(plans)
}

/// `key` under `prefix`, refusing keys that are not one plain object name: empty, with empty,
/// `.` or `..` segments, or with characters a path may not hold.
pub(crate) fn location(
    prefix: &object_store::path::Path,
    key: &str,
) -> Result<object_store::path::Path, object_store::path::Error> {
    let own = object_store::path::Path::parse(key)?;
    if key.is_empty() || own.as_ref() != key {
        return Err(object_store::path::Error::EmptySegment { path: key.into() });
    }
    Ok(own
        .parts()
        .fold(prefix.clone(), |p, part| p.clone().join(part)))
}

/// Checks that a write gives `plan`'s object whole (its runs cover it from 0 without gaps) and
/// returns its size.
///
/// # Errors
/// [`ObjectError::NotWhole`].
pub(crate) fn whole(plan: &ObjectPlan) -> Result<u64, ObjectError> {
    let mut end = 0u64;
    for s in &plan.segments {
        if s.offset != end {
            return Err(ObjectError::NotWhole {
                index: s.index,
                key: plan.key.clone(),
                offset: s.offset,
                expected: end,
            });
        }
        end += s.len;
    }
    Ok(end)
}

/// Checks `plan`'s runs against the object's `size`.
///
/// # Errors
/// [`ObjectError::OutOfRange`].
pub(crate) fn within(plan: &ObjectPlan, size: u64) -> Result<(), ObjectError> {
    for s in &plan.segments {
        if s.offset.checked_add(s.len).is_none_or(|end| end > size) {
            return Err(ObjectError::OutOfRange {
                index: s.index,
                key: plan.key.clone(),
                offset: s.offset,
                len: s.len,
                size,
            });
        }
    }
    Ok(())
}

/// Whether `plan` reads its whole object of `size` bytes in one run (so a stored whole-object
/// checksum can be checked).
pub(crate) fn covers(plan: &ObjectPlan, size: u64) -> bool {
    matches!(plan.segments.as_slice(), [s] if s.offset == 0 && s.len == size)
}

/// `plan`'s runs cut into requests of at most `part` bytes, in object order within each run.
pub(crate) fn ranges(plan: &ObjectPlan, part: u64) -> Vec<Range> {
    let part = part.max(1);
    let mut out = Vec::new();
    for s in &plan.segments {
        let mut done = 0u64;
        while done < s.len {
            let len = (s.len - done).min(part);
            out.push(Range {
                offset: s.offset + done,
                len,
                stream: s.stream + done,
            });
            done += len;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(key: &str, offset: u64, len: u64) -> ObjectDesc {
        ObjectDesc::new(key, offset, len)
    }

    fn prefix() -> object_store::path::Path {
        object_store::path::Path::from("kv/run1")
    }

    #[test]
    fn object_plan_groups_by_key_and_merges_adjacent_runs() {
        let plans = group(
            &prefix(),
            &[d("a", 0, 4), d("b", 0, 8), d("a", 4, 4), d("a", 8, 2)],
        )
        .unwrap();
        assert_eq!(plans.len(), 2);
        assert_eq!(plans[0].location.as_ref(), "kv/run1/a");
        // a@4 follows b in the stream, so it starts a new run; a@8 continues it.
        assert_eq!(
            plans[0].segments,
            vec![
                Segment {
                    index: 0,
                    offset: 0,
                    len: 4,
                    stream: 0
                },
                Segment {
                    index: 2,
                    offset: 4,
                    len: 6,
                    stream: 12
                },
            ]
        );
        assert_eq!(whole(&plans[0]).unwrap(), 10);
        assert_eq!(whole(&plans[1]).unwrap(), 8);
    }

    #[test]
    fn object_plan_refuses_holes_and_bad_keys() {
        let plans = group(&prefix(), &[d("a", 0, 4), d("a", 8, 4)]).unwrap();
        assert!(matches!(
            whole(&plans[0]),
            Err(ObjectError::NotWhole {
                index: 1,
                offset: 8,
                expected: 4,
                ..
            })
        ));
        let plans = group(&prefix(), &[d("a", 4, 4)]).unwrap();
        assert!(matches!(
            whole(&plans[0]),
            Err(ObjectError::NotWhole { index: 0, .. })
        ));
        for bad in ["", "a//b", "../x", "a/./b", "/a", "a/"] {
            assert!(
                matches!(
                    group(&prefix(), &[d("ok", 0, 1), d(bad, 0, 1)]),
                    Err(ObjectError::InvalidKey { index: 1, .. })
                ),
                "{bad:?}"
            );
        }
        assert_eq!(
            location(&prefix(), "layer/3/block-17").unwrap().as_ref(),
            "kv/run1/layer/3/block-17"
        );
    }

    #[test]
    fn object_plan_checks_ranges_and_cuts_parts() {
        let plans = group(&prefix(), &[d("a", 10, 25)]).unwrap();
        assert!(within(&plans[0], 35).is_ok());
        assert!(matches!(
            within(&plans[0], 34),
            Err(ObjectError::OutOfRange {
                size: 34,
                offset: 10,
                len: 25,
                ..
            })
        ));
        let plans = group(&prefix(), &[d("a", u64::MAX - 1, 4)]).unwrap();
        assert!(matches!(
            within(&plans[0], 100),
            Err(ObjectError::OutOfRange { .. })
        ));
        let plans = group(&prefix(), &[d("a", 0, 25)]).unwrap();
        assert!(covers(&plans[0], 25) && !covers(&plans[0], 26));
        let r = ranges(&plans[0], 10);
        assert_eq!(
            r.iter()
                .map(|r| (r.offset, r.len, r.stream))
                .collect::<Vec<_>>(),
            vec![(0, 10, 0), (10, 10, 10), (20, 5, 20)]
        );
    }
}
