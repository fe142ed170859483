// Tables marked class="sortable" sort by a column when its header is clicked (numbers as
// numbers, "1,234" included); a table with data-search gets a box that filters its rows.
(() => {
  const value = (cell) => {
    const text = cell.textContent.trim();
    const number = Number(text.replace(/[,\s%]|[A-Z]{3}$/g, ""));
    return text !== "" && !Number.isNaN(number) ? number : text.toLowerCase();
  };
  for (const table of document.querySelectorAll("table.sortable")) {
    table.querySelectorAll("thead th").forEach((header, index) => {
      header.classList.add("sorts");
      header.addEventListener("click", () => {
        const body = table.tBodies[0];
        const up = header.dataset.order !== "asc";
        table.querySelectorAll("thead th").forEach((h) => delete h.dataset.order);
        header.dataset.order = up ? "asc" : "desc";
        const rows = [...body.rows].filter((r) => r.cells.length > index);
        rows.sort((a, b) => {
          const x = value(a.cells[index]), y = value(b.cells[index]);
          return (x > y ? 1 : x < y ? -1 : 0) * (up ? 1 : -1);
        });
        rows.forEach((row) => body.appendChild(row));
      });
    });
  }
  for (const table of document.querySelectorAll("table[data-search]")) {
    const box = document.createElement("input");
    box.type = "search";
    box.placeholder = table.dataset.search;
    box.className = "table-search";
    box.setAttribute("aria-label", table.dataset.search);
    table.before(box);
    box.addEventListener("input", () => {
      const wanted = box.value.trim().toLowerCase();
      for (const row of table.tBodies[0].rows) row.hidden = wanted && !row.textContent.toLowerCase().includes(wanted);
    });
  }
})();
