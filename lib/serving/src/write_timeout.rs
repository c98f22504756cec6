//! A connection whose peer must keep reading: a write that cannot make progress for the limit
//! fails, so a client that stops reading its answer (its socket buffers full) is disconnected
//! (and its generation cancelled) instead of holding the connection, and a stopping server,
//! forever.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

pub(super) struct WriteTimeout<S> {
    inner: S,
    limit: Duration,
    /// Running while a write waits for the peer.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteTimeout<S> {
    pub fn new(inner: S, limit: Duration) -> Self {
        WriteTimeout {
            inner,
            limit,
            stalled: None,
        }
    }

    /// `poll` of the inner stream's write side, failing once it has waited `limit`.
    fn bounded<T>(
        &mut self,
        cx: &mut Context<'_>,
        poll: impl FnOnce(Pin<&mut S>, &mut Context<'_>) -> Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>>
    where
        S: Unpin,
    {
        match poll(Pin::new(&mut self.inner), cx) {
            Poll::Ready(outcome) => {
                self.stalled = None;
                Poll::Ready(outcome)
            }
            Poll::Pending => {
                let limit = self.limit;
                let timer = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the client read nothing for {} s", limit.as_secs_f64()),
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteTimeout<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteTimeout<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .bounded(cx, |inner, cx| inner.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .bounded(cx, |inner, cx| inner.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().bounded(cx, |inner, cx| inner.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn a_peer_that_stops_reading_fails_the_write_after_the_limit() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        runtime.block_on(async {
            let (ours, mut theirs) = tokio::io::duplex(64);
            let mut ours = WriteTimeout::new(ours, Duration::from_millis(200));
            // A reading peer: every write goes through, however long it all takes.
            let reader = tokio::spawn(async move {
                let mut got = vec![0u8; 1000];
                theirs.read_exact(&mut got).await.unwrap();
                theirs
            });
            for _ in 0..10 {
                ours.write_all(&[7u8; 100]).await.unwrap();
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            let _theirs = reader.await.unwrap();
            // Nobody reads any more: the buffer fills and the write fails after the limit.
            let started = std::time::Instant::now();
            let error = ours.write_all(&[7u8; 1000]).await.unwrap_err();
            assert_eq!(error.kind(), io::ErrorKind::TimedOut);
            let waited = started.elapsed();
            assert!(
                waited >= Duration::from_millis(200) && waited < Duration::from_secs(5),
                "{waited:?}"
            );
        });
    }
}
