//! Waiting for several futures at once (for striping a transfer over rails, or a test's batch of
//! concurrent transfers).

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

/// Polls every future until all are ready; their outputs in order.
pub async fn join_all<F: Future + Unpin>(mut futs: Vec<F>) -> Vec<F::Output> {
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match Pin::new(f).poll(cx) {
                    Poll::Ready(v) => *o = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_come_back_in_order() {
        let futs: Vec<_> = (0..5).map(|i| Box::pin(async move { i * 2 })).collect();
        assert_eq!(
            futures_lite::future::block_on(join_all(futs)),
            vec![0, 2, 4, 6, 8]
        );
    }
}
