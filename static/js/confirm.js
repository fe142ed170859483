// Forms that do something destructive carry data-confirm: ask before submitting them; buttons
// with data-copy copy the text of an element.
document.addEventListener("submit", (event) => {
  const message = event.target.dataset && event.target.dataset.confirm;
  if (message && !window.confirm(message)) event.preventDefault();
});
// Buttons with data-copy copy the text of the element of that id.
document.addEventListener("click", async (event) => {
  const button = event.target.closest && event.target.closest("[data-copy]");
  if (!button) return;
  const source = document.getElementById(button.dataset.copy);
  if (!source) return;
  await navigator.clipboard.writeText(source.textContent.trim());
  const label = button.textContent;
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = label; }, 1500);
});
