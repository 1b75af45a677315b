/* Delay line of the emulated cluster: per-packet one-way latency where the kernel has no netem.
 *
 * usage: delayline TAP:DELAY_US [TAP:DELAY_US ...]
 *
 * Creates one tap device per argument in the calling network namespace, prints "ready" once they
 * exist, then returns every frame the kernel sends into a tap (tc mirred redirects them there) to
 * that same tap as a received frame, DELAY_US microseconds later. The delay of a tap is constant,
 * so one FIFO per tap keeps frames in order; a timerfd wakes the loop at the next due frame.
 * Runs until killed (the cluster's teardown kills every process in its namespaces).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define MAX_TAPS 8
#define RING 65536 /* frames in flight per tap: 10 ms at 400 Mbit/s is ~60 jumbo frames */
#define FRAME 65536

struct frame { uint64_t due; size_t len; unsigned char *data; };
struct tap { int fd; uint64_t delay_ns; struct frame ring[RING]; size_t head, tail; };

static struct tap taps[MAX_TAPS];

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int open_tap(const char *name) {
    struct ifreq ifr;
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK);
    if (fd < 0) { perror("delayline: /dev/net/tun"); exit(1); }
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TAP | IFF_NO_PI;
    strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0) { perror("delayline: TUNSETIFF"); exit(1); }
    return fd;
}

/* Read every frame waiting on the tap and queue it with its due time. */
static void take(struct tap *t) {
    static unsigned char buf[FRAME];
    for (;;) {
        ssize_t n = read(t->fd, buf, sizeof buf);
        if (n <= 0) return; /* EAGAIN: drained */
        if ((t->tail + 1) % RING == t->head) continue; /* full: drop, as a link would */
        struct frame *f = &t->ring[t->tail];
        f->data = malloc((size_t)n);
        memcpy(f->data, buf, (size_t)n);
        f->len = (size_t)n;
        f->due = now_ns() + t->delay_ns;
        t->tail = (t->tail + 1) % RING;
    }
}

/* Hand back every due frame; return the due time of the next one (0: none queued). */
static uint64_t release(struct tap *t, uint64_t now) {
    while (t->head != t->tail && t->ring[t->head].due <= now) {
        struct frame *f = &t->ring[t->head];
        if (write(t->fd, f->data, f->len) < 0 && errno != EAGAIN) perror("delayline: write");
        free(f->data);
        t->head = (t->head + 1) % RING;
    }
    return t->head != t->tail ? t->ring[t->head].due : 0;
}

int main(int argc, char **argv) {
    int ntaps = argc - 1;
    if (ntaps < 1 || ntaps > MAX_TAPS) { fprintf(stderr, "usage: delayline TAP:DELAY_US ...\n"); return 2; }
    int ep = epoll_create1(0);
    int timer = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = MAX_TAPS};
    epoll_ctl(ep, EPOLL_CTL_ADD, timer, &ev);
    for (int i = 0; i < ntaps; i++) {
        char *colon = strchr(argv[i + 1], ':');
        if (!colon) { fprintf(stderr, "delayline: %s is not TAP:DELAY_US\n", argv[i + 1]); return 2; }
        *colon = '\0';
        taps[i].delay_ns = (uint64_t)(atof(colon + 1) * 1000.0);
        taps[i].fd = open_tap(argv[i + 1]);
        ev.data.u32 = (uint32_t)i;
        epoll_ctl(ep, EPOLL_CTL_ADD, taps[i].fd, &ev);
    }
    printf("ready\n");
    fflush(stdout);
    struct epoll_event events[MAX_TAPS + 1];
    for (;;) {
        int n = epoll_wait(ep, events, MAX_TAPS + 1, -1);
        for (int i = 0; i < n; i++) {
            if (events[i].data.u32 == MAX_TAPS) {
                uint64_t expirations;
                if (read(timer, &expirations, sizeof expirations) < 0) { /* spurious wake-up */ }
            } else {
                take(&taps[events[i].data.u32]);
            }
        }
        uint64_t now = now_ns(), next = 0;
        for (int i = 0; i < ntaps; i++) {
            uint64_t due = release(&taps[i], now);
            if (due && (!next || due < next)) next = due;
        }
        struct itimerspec at = {0};
        if (next) {
            at.it_value.tv_sec = (time_t)(next / 1000000000ull);
            at.it_value.tv_nsec = (long)(next % 1000000000ull);
        }
        timerfd_settime(timer, TFD_TIMER_ABSTIME, &at, NULL); /* all zero disarms it */
    }
}
